"""batchyard: an LLM serving engine whose scheduler is a pluggy plugin framework."""

import pluggy

PROJECT_NAME = "batchyard"

#: The one marker every plugin, bundled or third-party, uses: `from framework import hookimpl`.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

__version__ = "0.1.0"


def __getattr__(name):
    # Engine and Settings pull in torch and pydantic; import them lazily so `import framework`
    # (done by every plugin module) stays cheap.
    if name == "Engine":
        from framework.engine import Engine

        return Engine
    if name == "Settings":
        from framework.config import Settings

        return Settings
    raise AttributeError(name)


__all__ = ["hookimpl", "hookspec", "Engine", "Settings", "PROJECT_NAME"]
