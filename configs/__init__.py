"""Named configs: `configs/<name>.py` exports `get_config() -> Config`.

`gemjax.config.load(name)` reads these files by path (this directory
relative to the working directory, or another one given as `directory=` /
`--configs-dir`), so the library never imports this package.
"""
