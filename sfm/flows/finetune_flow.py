"""Labelled surveys + a registered encoder -> a fine-tuned segmentation model, scored on held-out labels,
registered as ``sfm-<task-name>/vN``; with ``--compare True``, beside the baselines users recognise.

    sfm flow finetune run --surveys a.sgy --labels a-faults.sgy --held-out 0.2 --task-name faults
    sfm flow finetune run --surveys a.sgy,b.sgy --labels a.npy,b.npy --held-out c.sgy \\
        --held-out-labels c.npy --encoder sfm-mae:v3 --task classes:4 --task-name facies --procs-per-node 4
    sfm flow finetune run ... --encoder random  # a baseline: the champion's architecture, randomly initialised
    sfm flow finetune run ... --encoder unet --baseline-of sfm-mae:v3  # a U-Net from scratch at v3's crop
    sfm flow finetune run ... --compare True --seeds 3  # the encoder and both baselines, paired seeds
    sfm flow finetune run ... --set "finetune.steps=200;finetune.head=unetr"   # any config key

The arms are built alike (:func:`sfm.finetune.run.resolve_arms`): a baseline takes the architecture and crop of the
encoder it is compared with, and a ``[model]`` section that contradicts it is refused. Each arm trains at the rate of
its grid its validation labels prefer, for steps that grow with the labels; the one registered is the best on the
validation labels, and ``end`` prints every arm's held-out scores, mean +- sd over the seeds (the card shows them).

``sfm flow finetune ...`` runs this file; in a checkout ``python flows/finetune_flow.py ...`` is the same flow.
Each step calls one function of ``sfm.finetune.run`` and keeps only small artifacts (URLs, ids, metrics).
The recipe is the ``[finetune]`` section of the job config (sfm/config.py: FinetuneConfig). Every parameter that
sets the job defaults to the config's value (``--help`` shows it); ``start`` resolves the config once
(``job_config``), ``launch`` makes the typed job every rank and later step reads (``job``: a FinetuneJob).
"""

import tomllib

from metaflow import (Config, FlowSpec, Parameter, card, config_expr, current, parallel, step)

from sfm.config import DATA_ROOT, DEFAULT_TOML
from sfm.ops.cluster import SET_HELP, flow_job, job_of  # noqa: F401  (job_of: in the config expressions below)
from sfm.user_errors import in_flow


class FinetuneFlow(FlowSpec):
    config = Config("config", default=str(DEFAULT_TOML), parser=tomllib.loads,
                    help="TOML job config; its [finetune] section is the recipe (see sfm/config.py)")
    encoder = Parameter("encoder", default=config_expr("job_of(config).registry.model_name"),
                        help="a model reference of the registry in --data-root (sfm-mae: its champion, sfm-mae:v3, "
                        "sfm-mae:latest), an exported encoder's URL; or a baseline built like --baseline-of: random "
                        "(its architecture, randomly initialised) or unet (a U-Net from scratch at its crop); "
                        "default: the champion of the config's [registry] model_name")
    compare = Parameter("compare", default=False, type=bool, help="fine-tune --encoder beside both baselines built "
                        "like it (random, unet) on paired seeds; the best on the validation labels is registered")
    baseline_of = Parameter("baseline-of", default="", help="the encoder --encoder random or unet is built like "
                            "(a model reference or a folder); default: the champion of [registry] model_name")
    surveys = Parameter("surveys", default="", help="comma-separated surveys to fine-tune on: SEG-Y/MDIO URLs "
                        "(ingested), survey ids or survey store URLs")
    labels = Parameter("labels", default="", help="their labels, one per survey: SEG-Y with the survey's geometry, "
                       ".npy on its grid, Zarr/MDIO integer variable, or label ids")
    held_out = Parameter("held-out", default="", help="surveys scored, never trained on (with --held-out-labels), or "
                         "a fraction of each training survey's labelled lines (default: [finetune] held_out)")
    held_out_labels = Parameter("held-out-labels", default="", help="labels of the --held-out surveys")
    validation = Parameter("validation", default="", help="surveys early stopping scores (with --validation-labels); "
                           "default: [finetune] validation of the training labelled lines")
    validation_labels = Parameter("validation-labels", default="", help="labels of the --validation surveys")
    task = Parameter("task", default="binary", help="binary (class 1 against 0) | classes:N")
    task_name = Parameter("task-name", default="segmentation", help="the task model is registered as sfm-<task-name>, "
                          "e.g. faults: sfm-faults")
    data_root = Parameter("data-root", default=DATA_ROOT, help="local path or s3://bucket/prefix for all outputs")
    nodes = Parameter("nodes", default=config_expr("job_of(config).dist.nodes"), type=int,
                      help="nodes for the @parallel finetune step; default: the config's [dist] nodes")
    procs_per_node = Parameter("procs-per-node", default=config_expr("job_of(config).dist.procs_per_node"), type=int,
                               help="fine-tuning processes (ranks) per node; default: the config's [dist] "
                               "procs_per_node")
    seed = Parameter("seed", default=config_expr("job_of(config).finetune.seed"), type=int,
                     help="crops, augmentation and initialisation; default: the config's [finetune] seed")
    seeds = Parameter("seeds", default=config_expr("job_of(config).finetune.seeds"), type=int,
                      help="paired seeds --seed, --seed + 1, ...: every arm once per seed, on that seed's crops; "
                      "default: the config's [finetune] seeds")
    overrides = Parameter("set", default="", help=SET_HELP)

    @step
    def start(self):
        from sfm import storage
        from sfm.finetune import run

        with in_flow():
            cfg = flow_job(self.config, self.overrides, seed=self.seed, seeds=self.seeds, nodes=self.nodes,
                           procs_per_node=self.procs_per_node)
            fraction = run.held_out_fraction(self.held_out)
            if fraction is not None:
                cfg.set("finetune.held_out", fraction)
            cfg.validate()
            self.job_config = cfg
            self.root = storage.normalize(self.data_root)
            self.arms = run.resolve_arms(self.encoder, self.root, cfg, compare=self.compare,
                                         baseline_of=self.baseline_of)
            run.check_task(self.task, cfg, self.arms)
            self.plan = run.plan_pairs(self.surveys, self.labels, self.held_out, self.held_out_labels,
                                       self.validation, self.validation_labels)
        self.next(self.ingest)

    @step
    def ingest(self):
        """Every survey and its labels published (those published before are found, not copied)."""
        from sfm.ingest.labels import ingest_pairs

        with in_flow():
            self.pairs = ingest_pairs(self.plan, self.root, self.job_config.ingest)
        self.next(self.launch)

    @step
    def launch(self):
        """The job every rank reads; fan out to the nodes (Metaflow needs a step before a @parallel split)."""
        from sfm import storage
        from sfm.ops import pipeline
        from sfm.finetune import run

        run_root = pipeline.run_root(self.root, current.flow_name, current.run_id)
        with in_flow():
            self.job = run.node_job(self.job_config, self.pairs, self.arms, self.task, storage.normalize(run_root))
        self.next(self.finetune, num_parallel=self.job.config.dist.nodes)

    @parallel
    @step
    def finetune(self):
        from sfm.finetune import run

        with in_flow():
            self.summary = run.finetune_node(self.job, nodes=current.parallel.num_nodes,
                                             node_index=current.parallel.node_index,
                                             main_addr=current.parallel.main_ip,
                                             rendezvous_key=f"{current.run_id}-{current.retry_count}")
        self.next(self.evaluate)

    @card(type="blank", id="finetune", timeout=600)
    @step
    def evaluate(self, inputs):
        """Every arm's held-out AP, F1, F1 at 2 voxels and IoU (per class for several), and the card: the arms' scores,
        a held-out line, its labels, each arm's prediction."""
        from sfm.finetune import run
        from sfm.finetune.card import finetune_components

        self.merge_artifacts(inputs, exclude=["summary"])
        self.summary = next(i.summary for i in inputs if i.summary is not None)
        with in_flow():
            self.metrics, figures = run.evaluate(self.job, self.summary)
        for component in finetune_components(self.metrics, self.summary, figures):
            current.card["finetune"].append(component)
        self.next(self.register)

    @step
    def register(self):
        from metaflow import Run

        from sfm.finetune import run

        pathspec = f"{current.flow_name}/{current.run_id}"
        with in_flow():
            record = run.register(self.root, self.task_name, self.job, self.summary, self.metrics, pathspec)
        self.model_name, self.model_version, self.champion = record["model_name"], record["version"], record["champion"]
        Run(pathspec).add_tag(f"model:{self.model_name}:v{self.model_version}")
        self.next(self.end)

    @step
    def end(self):
        from sfm.finetune import run

        m = self.metrics
        print(f"fine-tuned the {m['arm']} arm from {self.summary['encoder']}: held-out AP {m['ap']:.4f}, F1 "
              f"{m['f1']:.4f}, IoU {m['iou']:.4f}; registered {self.model_name} v{self.model_version}"
              f"{' (champion)' if self.champion else ''}\nheld-out scores per arm, mean +- sd over the seeds:\n"
              f"{run.compare_table(m)}")


if __name__ == "__main__":
    FinetuneFlow()
