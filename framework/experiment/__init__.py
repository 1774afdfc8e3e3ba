"""`batchyard experiment`: a grid of plugin choices × workloads × rates × seeds, each cell a run of
the real scheduler and plugins on the `sim` worker (or the real model), compared in one table and
a set of plots. Modules: `spec` (the file, its checks, the grid), `runner` (cells in processes or
on Ray), `metrics`, `report` (results.jsonl, table.md), `plots`, `cli`."""
