"""Config machinery shared by every component (see schema.py)."""
from bertdist.config.schema import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    load_yaml,
    save_config,
    to_dict,
)

__all__ = [
    "ConfigError",
    "apply_overrides",
    "from_dict",
    "load_config",
    "load_yaml",
    "save_config",
    "to_dict",
]
