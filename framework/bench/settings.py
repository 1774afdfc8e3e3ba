"""Engine settings for the in-process tools: the usual --config/--section.field flags, plus the
bench's --dtype shortcut, plus whatever a tool must force (one-batch needs one unchunked prefill)."""

from __future__ import annotations

from typing import Any


def bench_settings(args, **sections: dict[str, Any]):
    """Settings from the command line; `sections` (e.g. scheduler={...}) are applied last."""
    from framework.cli import settings_from_args

    settings = settings_from_args(args)
    if getattr(args, "dtype", None):
        settings.model.dtype = args.dtype
    for section, values in sections.items():
        target = getattr(settings, section)
        for key, value in values.items():
            setattr(target, key, value)  # validated: the sections use validate_assignment
    return settings


def settings_record(settings) -> dict[str, Any]:
    """The settings as JSON for a result record.

    Plugin sections are validated models stored in a dict-typed field, which pydantic serializes
    correctly but warns about; the warning is noise here.
    """
    return settings.model_dump(mode="json", warnings=False)
