"""The shipped YAML configs: `default.yaml`, the config groups (`dataset/`, `algorithm/`),
`experiments/` and `sweeps/`. A package only so that an installed raysim finds them with
`importlib.resources`; it holds no code."""
