"""Named configs: `configs/<name>.py` exports `get_config() -> Config`."""
