"""The core configuration schema: typed dataclasses, one per section, with their defaults.

OmegaConf builds the structured config from them, so an unknown key or a wrongly typed value
is caught by name when the layers are merged (raysim.config.layers); the ranges are checked
in raysim.config.validate. Plugin sections are added to this by raysim.config.sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf


AUGMENTATIONS = ("none", "colour", "crop_flip")  # local.augment, see raysim/data/augment.py


def augmentation_name(value) -> str:
    """`local.augment` as one of AUGMENTATIONS (true means colour, false none); else ValueError."""
    if value is True:
        return "colour"
    if value is False or value is None:
        return "none"
    if isinstance(value, str) and value in AUGMENTATIONS:
        return value
    raise ValueError(value)


@dataclass
class PartitionConfig:
    name: str = "dirichlet"  # iid | dirichlet | classes | shards | quantity | power_law | classes_power_law | natural | contiguous
    beta: float = 0.5  # Dirichlet concentration (dirichlet: over labels, quantity: over sizes)
    k: int = 2  # classes, classes_power_law: labels per client (#C=k)
    shards_per_client: int = 2  # shards: label-sorted shards per client
    sigma: float = 2.0  # power_law, classes_power_law: sigma of the log-normal client sizes
    min_size: int = 10  # fewest training samples a client may hold (NIID-Bench's rule for dirichlet / quantity)
    max_draws: int = 100  # dirichlet / quantity: redraws before the best draw is topped up to min_size
    test_fraction: float = 0.0  # share of each client's samples kept as its local test set


@dataclass
class LongTailConfig:
    imbalance: float = 1.0  # IF: the training set keeps n_max * IF^(-c/(C-1)) of class c (1: as it is)


@dataclass
class EvalConfig:
    # many / medium / few-shot class groups by training samples (after long_tail): a class
    # with more than shots[0] samples is many-shot, fewer than shots[1] few-shot (CReFF's
    # CIFAR-10-LT: > 1500, < 200)
    shots: List[int] = field(default_factory=lambda: [1500, 200])
    tau_norm: float = 0.0  # > 0: evaluate every model with classifier rows w_c / ||w_c||^tau (0: off)
    # > 0: also each client's model fine-tuned this many epochs on its own training data, tested on
    # its own test split (`personal_accuracy`: FedAvg-FT for any algorithm; needs partition.test_fraction)
    finetune_epochs: int = 0
    # > 0: validation mode (tuning): this share of each client's training samples is held out, and every
    # evaluation, global and per client, is on those samples instead of a test set (raysim/data/validation.py)
    validation: float = 0.0
    # where the global test set is evaluated: server (its CPU), clients (a client actor's device: its GPU),
    # auto (clients when the client actors train on CUDA, else server): runtime/remote_eval.py
    where: str = "auto"
    # > 0: each evaluation round, this many clients (drawn afresh, among those there) are evaluated on their own
    # test splits instead of every client: a population of millions (issue 73). 0: every client
    local_clients: int = 0


@dataclass
class PersonalConfig:
    """What the personalised algorithms built on algorithms/_personal.py (FedPer, FedRep, LG-FedAvg, Ditto, APFL,
    FedBABU, FedBN, FedRoD, FedProto) share."""

    # the shared part's BatchNorm statistics: `shared` (averaged and broadcast, like the parameters) or
    # `local` (each client keeps its own: FedBN's rule, and PFLlib's, whose servers send parameters only)
    buffers: str = "shared"


@dataclass
class LogConfig:
    """Trackers beside the run directory (raysim/runtime/trackers.py): the config, each round's metrics, the summary."""

    tensorboard: bool = False  # <run dir>/tensorboard (the `tensorboard` extra)
    wandb: bool = False  # Weights & Biases (the `wandb` extra)
    wandb_project: str = "raysim"
    wandb_mode: str = "online"  # online | offline (files in <run dir>/wandb; `wandb sync` later) | disabled
    mlflow: bool = False  # MLflow (the `mlflow` extra)
    mlflow_uri: Optional[str] = None  # tracking URI (default: a local database, sqlite:///<output_dir>/mlflow.db)
    mlflow_experiment: str = "raysim"  # the experiment, when no log.group
    group: Optional[str] = None  # groups the trackers' runs (W&B group, MLflow experiment); a sweep sets its name


@dataclass
class LocalConfig:
    epochs: int = 1
    steps: int = 0  # > 0: this many SGD steps instead of `epochs` epochs
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-5
    lr_decay: float = 1.0  # lr in round r is lr * lr_decay ** (r - 1)
    clip_grad_norm: Optional[float] = None  # > 0: each step's gradient clipped to this L2 norm (one norm over the
    # trained parameters, torch's clip_grad_norm_, after any gradient hook), as FedDyn's authors' code clips each
    # method it runs (10); None: no clipping
    augment: Any = False  # false | colour (= true; FedEntOpt's) | crop_flip (NIID-Bench's): see raysim/data/augment.py
    focal_gamma: float = 0.0  # > 0: the focal loss instead of cross-entropy (algorithms that train on the plain loss)
    vectorize: bool = False  # train groups of clients as one batched program (raysim/vectorized.py)
    vectorize_group: int = 64  # clients per group, cut from the sorted cohort by client id


@dataclass
class ResourcesConfig:
    clients_per_actor: Any = "auto"  # "auto" (one actor per CPU share) or an int; 1 = actor per client
    num_actors: Optional[int] = None  # this many client actors (wins over clients_per_actor); on an
    # autoscaling cluster the autoscaler adds nodes until they fit
    num_cpus_per_actor: Optional[float] = None  # None: 1 CPU each, or an equal share of the CPUs when
    # clients_per_actor asks for more actors than there are CPUs
    num_gpus_per_actor: Any = 0.0  # a GPU fraction, or "auto": as many actors per GPU as fit one client update's
    # measured GPU memory (runtime/gpu_packing.py)
    gpu_memory_headroom: float = 0.1  # num_gpus_per_actor=auto: the fraction of each GPU's memory kept free
    torch_threads: int = 1  # torch intra-op threads in each client actor
    server_threads: int = 0  # torch intra-op threads of the server's own work (evaluation, CReFF's and CCVR's
    # re-training); 0: every CPU of its machine. A sweep sets it to the CPUs a point may use beside its actors (at least
    # 1): two servers of 2 threads on 2 busy cores spin, 45x slower on CReFF's 9,600 small steps a round (measured)
    tasks_per_actor: Optional[int] = None  # an actor's clients of a round in up to this many tasks, so the server folds
    # the first tasks' models while it trains the rest; None: 4 where actors hold a GPU and models are >= 1 MB, else 1
    placement_timeout: float = 600.0  # seconds to wait for the client actors to be placed (a cluster
    # that scales up starts hosts meanwhile)
    client_state_gb: Optional[float] = None  # stateful algorithms: GB of client states the server keeps in
    # memory; the least recently used beyond it go to a file (runtime/state_store.py). None: the size of Ray's
    # object store, at most a third of the free memory
    lost_actor_wait: float = 120.0  # seconds a run waits for Ray to bring back a client actor when every
    # one is lost (a host lost with all of them); then it stops, naming the checkpoint to resume from
    ray_start_s: float = 8.0  # a command on its own machine trains the clients in its own process, with no Ray, when
    # they would train there in under ray_start_s x CPUs/(CPUs-1) seconds (runtime/here.py); 0: always Ray
    wave_mb: float = 32.0  # a round whose updates and states would pass two of these per actor goes in pieces of
    # this many MB, two in flight per actor (runtime/dispatch.py): the object store holds those, not the whole round


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a local Ray; "auto" or host:port: join a cluster
    dashboard: bool = False  # local Ray only: start the dashboard (costs ~1 GB RSS and ~1 s)
    num_cpus: Optional[int] = None  # local Ray only: CPUs to offer (default: all)
    metrics_port: Optional[int] = None  # local Ray only: the port its Prometheus endpoint serves on (127.0.0.1:PORT/metrics; default: Ray picks one)
    object_store_gb: Optional[float] = None  # local Ray only: its object store, GB (default: Ray's, 30% of memory, enlarged by the command when the data need it)
    # between runs in one Ray session (raysim.simulate in a notebook, a sweep, a test suite):
    # keep the server's and client actors' processes and reuse them (see runtime/pool.py)
    reuse_workers: bool = True


@dataclass
class SystemConfig:
    """System heterogeneity, for any algorithm (FedEntOpt's robustness runs). Stragglers
    vary the number of epochs, so they have no effect when `local.steps` is set."""

    dropout: float = 0.0  # probability that a selected client does not return its update
    stragglers: float = 0.0  # fraction of all clients that are stragglers (drawn once from the seed)
    straggler_epochs: List[int] = field(default_factory=lambda: [1, 5])  # a straggler's epochs: uniform in [lo, hi]
    profile: str = "none"  # simulated time (world/clock.py): none | uniform | mobile | trace (devices from system.trace)
    trace: Optional[str] = None  # profile=trace: a CSV of devices, header gflops,down_mbps,up_mbps,latency_s
    deadline: Optional[float] = None  # simulated seconds a training call waits for its clients; later ones are dropped
    target_accuracy: Optional[float] = None  # summary.json: the simulated time the test accuracy first reaches this
    availability: str = "always"  # who is online when, in simulated time (world/online.py): always | diurnal | trace
    online_hours: float = 8.0  # availability=diurnal: hours online of each simulated day
    availability_trace: Optional[str] = None  # availability=trace: a CSV of online intervals, header client,start_s,end_s


@dataclass
class FaultsConfig:
    """Fault injection for tests and drills of the infrastructure. Every death is a real
    one: the client actor's process exits (`os._exit`), its calls are made again on the
    other actors (no result changes: runtime/dispatch.py) and Ray restarts it. Clients that
    fail as clients do: `system.dropout`."""

    crash_round: int = -1  # with crash_client: the actor training this client in this round dies
    crash_client: int = -1
    kill_fraction: float = 0.0  # this share of the client actors (at least one) dies in each of `kill_rounds`
    kill_rounds: List[int] = field(default_factory=list)


@dataclass
class JoinConfig:
    """Clients that join late (newcomers), for any algorithm and selection: see
    world/availability.py. Which clients are late is drawn once from the seed."""

    fraction: float = 0.0  # share of the clients (at least one when > 0) not there at the start
    round: int = 1  # the first round they can be selected
    over: int = 1  # they arrive in equal batches over this many rounds, from `round` on


@dataclass
class ClientsConfig:
    join: JoinConfig = field(default_factory=JoinConfig)


@dataclass
class ServerConfig:
    """The server's rule for algorithms that fold client models through raysim's server
    parts (`Algorithm.server_parts`): raysim/aggregation/."""

    aggregator: str = "mean"  # mean | median | trimmed_mean | krum | multi_krum | geometric_median | majority_vote
    optimizer: str = "sgd"  # sgd | momentum | adam | yogi | adagrad (Reddi et al.'s FedOpt)
    lr: float = 1.0  # the server's step eta (sgd with 1: the aggregate itself, FedAvg)
    momentum: float = 0.9  # momentum's beta
    beta1: float = 0.9  # adam / yogi / adagrad: first moment
    beta2: float = 0.99  # adam / yogi: second moment
    tau: float = 1e-3  # adam / yogi / adagrad: adaptivity (v starts at tau^2)
    fedopt: str = "reddi"  # reddi (the paper: v starts at tau^2, no bias correction) | flower (Flower's FedOpt: v starts at 0, adam's step bias-corrected)
    trim: float = 0.1  # trimmed_mean: the share cut at each end, per coordinate
    byzantine: int = 0  # krum / multi_krum: f, the attackers tolerated (needs a cohort > 2f + 2)
    krum_m: int = 1  # multi_krum: how many of the best-scored models are averaged
    partial_sums: int = 0  # > 0 (mean aggregator): client actors send one weighted sum per block of this many clients


@dataclass
class PrivacyConfig:
    """Differential privacy of the clients' data (raysim/privacy/): central (user level, for
    algorithms that fold their clients' updates through raysim's server parts) or local
    (sample level, DP-SGD in each client's training, for algorithms it covers)."""

    mode: str = "none"  # none | central (DP-FedAvg: each update clipped, Gaussian noise on their sum) | local (DP-SGD per client, Opacus)
    clip: float = 1.0  # the L2 bound: central, on a client's update (its trainable parameters' change); local, on a sample's gradient
    noise_multiplier: float = 0.0  # the noise's standard deviation is noise_multiplier * clip (central: on the sum; local: on each step's sum)
    target_epsilon: Optional[float] = None  # choose noise_multiplier so that `rounds` rounds spend this epsilon (wins; local: a client in every round)
    delta: Optional[float] = None  # the delta of (epsilon, delta); default central 1 / num_clients^1.1, local 1 / (largest client's samples)^1.1
    adaptive_clip: bool = False  # central: the clip follows a quantile of the update norms (Andrew et al. 2021); clip is its start
    target_quantile: float = 0.5  # adaptive: the share of updates the clip should leave unscaled
    clip_lr: float = 0.2  # adaptive: the clip's geometric step, clip * exp(-clip_lr * (unscaled share - target_quantile))
    clip_count_stddev: Optional[float] = None  # adaptive: the noise on the count of unscaled updates (default K / 20)
    secure_aggregation: str = "none"  # none | secagg (Bonawitz et al. 2017) | secagg_plus (Bell et al. 2020): the server sees only the sum (simulated)
    secagg_bits: int = 32  # secure aggregation: bits per entry of the masked update (its field)
    secagg_threshold: float = 0.5  # secure aggregation: the share of a client's neighbours whose shares rebuild its seeds
    secagg_neighbours: Optional[int] = None  # secagg_plus: each client's neighbours k (default 2 * ceil(log2(n) / 2))


@dataclass
class AttackConfig:
    """Adversarial clients, for any algorithm (raysim/attacks.py)."""

    kind: str = "none"  # none | label_flip | sign_flip | scaled | gaussian
    fraction: float = 0.0  # share of all clients that attack (drawn once from the seed; at least one when > 0)
    start: int = 1  # the first round they attack
    boost: float = 10.0  # scaled: the factor on the attacker's update
    scale: float = 1.0  # gaussian: the noise's standard deviation


@dataclass
class CompressConfig:
    """Compression of the update each client sends (raysim/compression/uplink.py)."""

    up: str = "none"  # none | topk | randk | qsgd | sign (scaled sign) | signsgd (bare signs, server.aggregator=majority_vote)
    ratio: float = 0.01  # topk / randk: the share of the update's entries sent
    bits: int = 8  # qsgd: bits per entry (a sign bit and bits - 1 of level)
    bucket: int = 512  # qsgd: entries that share one norm
    error_feedback: bool = False  # a client adds what its last messages dropped to its next update (its state)
    sign_scale: str = "update"  # sign: one mean magnitude for the whole update | tensor: one per parameter tensor (epfml/error-feedback-SGD's)


@dataclass
class Config:
    algorithm: str = "fedavg"
    selection: str = "random"
    dataset: str = "digits"
    model: str = "mlp"
    model_options: Dict[str, Any] = field(default_factory=dict)  # the model's own arguments, e.g. mlp's hidden
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    personal: PersonalConfig = field(default_factory=PersonalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    num_clients: int = 20
    clients_per_round: Optional[int] = None  # overrides participation when set
    participation: float = 0.5
    rounds: int = 30
    local: LocalConfig = field(default_factory=LocalConfig)
    seed: int = 0
    determinism: bool = True  # deterministic GPU kernels: the same bits on CUDA from run to run (runtime/determinism.py)
    eval_every: int = 1
    output_dir: str = "runs"
    run_name: Optional[str] = None  # default: <algorithm>-<dataset>-<timestamp>
    data_dir: str = "data"
    data_store: str = "auto"  # where the training arrays live: memory (Ray's object store) | files (raysim/data/store.py) | auto: files when they would crowd the store of a one-node Ray, else memory
    data_store_dir: Optional[str] = None  # data_store=files: where the files go (default $RAYSIM_CACHE_DIR/arrays); every node must read it
    download: bool = True
    input_scale: str = "standardize"  # images: standardize (per-channel mean / std) | unit (pixels in [0, 1])
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    plugins: List[str] = field(default_factory=list)  # extra modules that register plugins
    # stop a run as diverged when the server's model collapsed to chance without turning non-finite: its test
    # accuracy <= 1.5 / classes at three evaluations in a row after reaching 3 / classes (issue 84)
    diverged_collapse: bool = True
    checkpoint_every: int = 10  # write <run dir>/checkpoint.pt every N rounds and after the last (0: never)
    resume: Optional[str] = None  # a run directory: continue that run from its checkpoint


def clients_per_round(cfg: DictConfig) -> int:
    if cfg.clients_per_round is not None:
        return int(cfg.clients_per_round)
    return max(1, int(round(cfg.participation * cfg.num_clients)))


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
