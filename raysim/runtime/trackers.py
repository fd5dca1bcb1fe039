"""Experiment trackers beside the run directory: the tools users already open. Each gets the
run's config once, every round's numeric metrics (step = the round) and the final summary;
one tracker run per raysim run, a sweep's points grouped under the sweep's name
(`log.group`, which `raysim.sweep` sets).

- `log.tensorboard`: `<run dir>/tensorboard` (torch's SummaryWriter; the `tensorboard` extra);
- `log.wandb`: Weights & Biases (`wandb` extra): project `log.wandb_project`, the run named as
  its folder, grouped by `log.group`, `log.wandb_mode` online / offline (offline: files under
  `<run dir>/wandb`, `wandb sync` uploads them later) / disabled;
- `log.mlflow`: MLflow (`mlflow` extra): tracking URI `log.mlflow_uri` (default a local
  database, `sqlite:///<output_dir>/mlflow.db`, MLflow's own advice since its file store
  went into maintenance; a `file:` URI still gives a file store), experiment `log.group` or
  `log.mlflow_experiment`, the config as parameters.

A resumed run continues its tracker run where the tracker can (W&B: the same run id, kept in
`<run dir>/trackers.json`; MLflow: the same run id): the rounds after the checkpoint follow.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def numeric(row: dict) -> dict:
    """The row's numbers (not bools, not None, not NaN), for a tracker's scalars."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "round" and v == v}


def flat(config: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class TensorBoard:
    def __init__(self, run_dir: Path, cfg: dict, ids: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def round(self, row: dict) -> None:
        for key, value in numeric(row).items():
            self.writer.add_scalar(key, value, row["round"])
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        self.writer.close()


class WandB:
    def __init__(self, run_dir: Path, cfg: dict, ids: dict):
        import wandb

        log = cfg["log"]
        self.run = wandb.init(project=log["wandb_project"], name=run_dir.name, group=log.get("group"),
                              config=cfg, dir=str(run_dir), mode=log["wandb_mode"], id=ids.get("wandb"),
                              resume="allow", reinit="create_new")
        ids["wandb"] = self.run.id

    def round(self, row: dict) -> None:
        self.run.log(numeric(row), step=int(row["round"]))

    def finish(self, summary: dict) -> None:
        for key, value in numeric(summary).items():
            self.run.summary[key] = value
        self.run.finish()


class MLflow:
    def __init__(self, run_dir: Path, cfg: dict, ids: dict):
        import mlflow

        log = cfg["log"]
        uri = log.get("mlflow_uri") or f"sqlite:///{Path(cfg['output_dir']).expanduser().resolve() / 'mlflow.db'}"
        if uri.startswith("file:") or "://" not in uri:  # a file store, asked for by name: MLflow 3 wants the opt-in
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = log.get("group") or log["mlflow_experiment"]
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        if ids.get("mlflow"):
            self.run_id = ids["mlflow"]
        else:
            self.run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
            params = [mlflow.entities.Param(k, str(v)[:500]) for k, v in flat(cfg).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        ids["mlflow"] = self.run_id

    def round(self, row: dict) -> None:
        import time

        import mlflow

        now = int(time.time() * 1000)
        metrics = [mlflow.entities.Metric(k, v, now, int(row["round"])) for k, v in numeric(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, summary: dict) -> None:
        for key, value in numeric(summary).items():
            self.client.log_metric(self.run_id, f"summary.{key}", value)
        self.client.set_terminated(self.run_id)


KINDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _first_line(e: Exception, limit: int = 160) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


class Trackers:
    """The trackers `log.*` turns on, for one run directory. One that cannot open is a
    ConfigError naming its key (the caller removes the new run directory); one that fails
    mid-run is dropped with a line for the run's log: the run directory has everything."""

    def __init__(self, run_dir: Path, cfg: dict, resumed: bool = False):
        self.path = Path(run_dir) / "trackers.json"
        ids = json.loads(self.path.read_text()) if resumed and self.path.is_file() else {}
        self.active: list = []
        for name, cls in KINDS.items():
            if not cfg["log"].get(name):
                continue
            try:
                self.active.append((name, cls(Path(run_dir), cfg, ids)))
            except Exception as e:  # a bad URI, an unreachable server, a folder it cannot write
                self.close()
                from raysim.errors import ConfigError

                what = _first_line(e)
                raise ConfigError(f"log.{name}=true: the tracker did not open ({type(e).__name__}"
                                  f"{': ' + what if what else ''}); check its log.* settings or turn it off") from None
        if self.active:
            self.path.write_text(json.dumps(ids))

    def _each(self, call: str, arg: dict, when: str) -> list[str]:
        failed = []
        for name, t in list(self.active):
            try:
                getattr(t, call)(arg)
            except Exception as e:
                self.active.remove((name, t))
                first = _first_line(e)
                failed.append(f"log.{name}: the tracker failed {when} ({type(e).__name__}{': ' + first if first else ''}); "
                              "no longer logging to it (the run directory has every round)")
        return failed

    def round(self, row: dict) -> list[str]:
        """Log the round to each tracker; the lines to log for trackers that failed."""
        return self._each("round", row, f"in round {row.get('round')}")

    def finish(self, summary: dict) -> list[str]:
        failed = self._each("finish", summary, "at the end")
        self.active = []
        return failed

    def close(self) -> None:
        """Close what opened (a tracker after it failed to open), quietly."""
        for _, t in self.active:
            try:
                t.finish({})
            except Exception:
                pass
        self.active = []
