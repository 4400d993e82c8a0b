"""SEG-Y surveys -> Zarr survey stores -> distributed 3D ViT-MAE pretraining -> evaluation -> registered model.

    sfm flow pretrain run                                  # embedded demo: synthetic surveys, tiny model, CPU
    sfm flow pretrain run --surveys s3://b/landing/a.sgy,s3://b/landing/b.sgy \\
        --held-out s3://b/landing/c.sgy --data-root s3://b/sfm --preset base --nodes 4 --procs-per-node 8 \\
        --cp 2                                             # 32 ranks: 16 dp groups x 2 context-parallel ranks
    sfm flow pretrain run --surveys s3://b/landing/big.sgy,... --ingest-parts 32
                                                           # each survey scanned and written by up to 32 tasks
    sfm flow pretrain run --launcher accelerate --accelerate-config fsdp2.yaml
                                                           # accelerate launch on every node; the Accelerate
                                                           # config's FSDP2, precision and sizes mapped at start
    sfm flow pretrain --config config quality_cpu run      # a packaged job config (sfm/configs/), or a TOML file
    sfm flow pretrain resume                               # after a failure: training continues from its checkpoint

``sfm flow pretrain ...`` runs this file; in a checkout ``python flows/pretrain_flow.py ...`` is the same flow.
Each step calls one function of ``sfm.ops.pipeline`` and keeps only small artifacts (URLs, ids, metrics). Every
parameter that sets the job defaults to the config's value (``--help`` shows it); ``start`` resolves the job once
(``job``: the typed JobConfig, which the later steps read as it is).
"""

import tomllib

from metaflow import (Config, FlowSpec, Parameter, card, config_expr, current, environment, parallel, resources,
                      retry, schedule, step, trigger)

# used by the config expressions below
from sfm.ops.cluster import job_of, kubernetes_placement, node_environment, pod_resources  # noqa: F401
from sfm.config import DEFAULT_TOML
from sfm.ops.schedule import schedule_cron, trigger_event  # noqa: F401
from sfm.user_errors import in_flow


@schedule(cron=config_expr("schedule_cron(config)"), daily=config_expr("schedule_cron(config) is not None"))
@trigger(event=config_expr("trigger_event(config)"))
class PretrainFlow(FlowSpec):
    config = Config("config", default=str(DEFAULT_TOML), parser=tomllib.loads,
                    help="TOML job config (see sfm/default.toml); the parameters below override it")
    surveys = Parameter("surveys", default="", help="comma-separated SEG-Y or MDIO v1 (.mdio) URLs (local or s3://), "
                        "or a JSON list; MDIO stores are read in place; "
                        "empty: generate three synthetic demo surveys into <data-root>/landing")
    held_out = Parameter("held-out", default="", help="SEG-Y URLs (as --surveys) evaluated but never trained on "
                         "(default: the last of --surveys)")
    data_root = Parameter("data-root", default="sfm_data", help="local path or s3://bucket/prefix for all outputs")
    preset = Parameter("preset", default=config_expr("job_of(config).model.preset"),
                       help="model preset (tiny|small|base|large|huge); default: the config's [model] preset")
    max_steps = Parameter("max-steps", default=config_expr("job_of(config).train.max_steps"), type=int,
                          help="training steps; default: the config's [train] max_steps")
    nodes = Parameter("nodes", default=config_expr("job_of(config).dist.nodes"), type=int,
                      help="nodes for the @parallel pretrain step; default: the config's [dist] nodes")
    procs_per_node = Parameter("procs-per-node", default=config_expr("job_of(config).dist.procs_per_node"), type=int,
                               help="training processes per node; default: the config's [dist] procs_per_node")
    cp = Parameter("cp", default=config_expr("job_of(config).dist.cp"), type=int,
                   help="context-parallel ranks per volume (nodes x procs-per-node must divide by it); "
                   "default: the config's [dist] cp")
    strategy = Parameter("strategy", default=config_expr("job_of(config).dist.strategy"),
                         help="data-parallel strategy: ddp | fsdp2-zero2 | fsdp2-full | deepspeed-zero2 | "
                         "deepspeed-zero3 (the deepspeed extra); default: the config's")
    launcher = Parameter("launcher", default=config_expr("job_of(config).dist.launcher"),
                         help="what starts each node's training processes: torchrun | accelerate (accelerate "
                         "launch); default: the config's [dist] launcher")
    accelerate_config = Parameter("accelerate-config", default=config_expr("job_of(config).dist.accelerate_config"),
                                  help="an Accelerate config file (as `accelerate config` writes it) mapped onto "
                                  "the job at start: precision, machines, processes, FSDP2 or DeepSpeed ZeRO "
                                  "stage; a conflicting one is refused; default: the config's [dist]")
    ingest_parts = Parameter("ingest-parts", default=config_expr("job_of(config).ingest.parts"), type=int,
                             help="tasks to split each survey's ingest into (whole 4 GiB pieces to scan, whole shard "
                             "rows to write); 0: one per [ingest] part_gb GB; default: the config's [ingest] parts")
    init_from = Parameter("init-from", default=config_expr("job_of(config).train.init_from"),
                          help="continue pretraining from these weights: an exported model folder URL, or "
                          "champion|latest|vN of the registry in --data-root; default: the config's [train] init_from")

    @step
    def start(self):
        from sfm import storage
        from sfm.ops import pipeline

        with in_flow():
            self.root = storage.normalize(self.data_root)
            job = pipeline.job_config(job_of(self.config).override(
                preset=self.preset, max_steps=self.max_steps, nodes=self.nodes, procs_per_node=self.procs_per_node,
                cp=self.cp, strategy=self.strategy, launcher=self.launcher, accelerate_config=self.accelerate_config,
                ingest_parts=self.ingest_parts))
            self.job = pipeline.resolve_init_from(job, self.init_from, self.root)
            self.plan = pipeline.plan_surveys(self.surveys, self.held_out, self.root, self.job.synth)
        self.run_key = current.run_id  # a resumed run clones this step, so it keeps the original key
        with in_flow():
            self.scans = pipeline.plan_ingest(self.plan, self.root, self.job, self.run_key)
        self.next(self.scan, foreach="scans")

    # a killed scan or write part is retried at once, then `resume` runs only the parts that failed
    @retry(times=1, minutes_between_retries=0)
    @step
    def scan(self):
        """Digest and header fields of one part (whole 4 GiB pieces) of one survey."""
        from sfm.ops import pipeline

        with in_flow():
            self.scanned = pipeline.scan_part(self.input, self.job)
        self.next(self.plan_ingest)

    @step
    def plan_ingest(self, inputs):
        """Each survey's identity, geometry and store arrays; its parts fan out to the write tasks."""
        from sfm.ops import pipeline

        self.merge_artifacts(inputs, include=["job", "root", "run_key"])
        with in_flow():
            self.parts = pipeline.plan_writes([i.scanned for i in inputs], self.root, self.job)
        self.next(self.split_parts)

    @step
    def split_parts(self):
        """Fan out to the write tasks (Metaflow needs a step between a join and a foreach)."""
        self.next(self.ingest, foreach="parts")

    @retry(times=1, minutes_between_retries=0)
    @step
    def ingest(self):
        """The shards of one part (whole shard rows) of one survey."""
        from sfm.ops import pipeline

        with in_flow():
            self.part = pipeline.ingest(self.input, self.job)
        print(f"sfm ingest: part {self.part['part'] + 1} of {self.part['write_parts']} of {self.part['url']}: "
              f"{self.part['columns']} brick columns")
        self.next(self.join)

    @step
    def join(self, inputs):
        from sfm.ops import pipeline
        from sfm.formats import manifest

        self.merge_artifacts(inputs, include=["job", "root", "run_key"])
        with in_flow():
            surveys = pipeline.publish([i.part for i in inputs], self.root)
        for s in surveys:
            print(f"sfm ingest: {s['name']} -> {s['store_url']} ({s['status']})")
        self.train_stores = [s["store_url"] for s in surveys if not s["held_out"]]
        self.held_out_stores = [s["store_url"] for s in surveys if s["held_out"]]
        self.survey_ids = [s["survey_id"] for s in surveys]
        self.manifest_version = manifest.version(self.root)
        self.next(self.launch)

    @step
    def launch(self):
        """Fan out to the training nodes (Metaflow needs a step between a join and a @parallel split)."""
        self.next(self.pretrain, num_parallel=self.job.dist.nodes)

    # a failed attempt (killed process, lost node) is retried once at once; training continues from
    # its last checkpoint, as it does after `resume`
    @retry(times=1, minutes_between_retries=0)
    @parallel
    @resources(cpu=config_expr("pod_resources(config)['cpu']"), memory=config_expr("pod_resources(config)['memory']"),
               disk=config_expr("pod_resources(config)['disk']"), gpu=config_expr("pod_resources(config)['gpu']"),
               shared_memory=config_expr("pod_resources(config)['shared_memory']"))
    @environment(vars=config_expr("node_environment(config)"))
    @kubernetes_placement  # on Kubernetes: [cluster] instance type, tolerations, image, EFA devices
    @step
    def pretrain(self):
        from sfm.ops import pipeline

        self.run_root = pipeline.run_root(self.root, current.flow_name, self.run_key)  # checkpoints, model, summary
        with in_flow():
            self.train_summary = pipeline.pretrain_node(
                self.job, train_stores=self.train_stores, run_root=self.run_root,
                nodes=current.parallel.num_nodes, node_index=current.parallel.node_index,
                main_addr=current.parallel.main_ip, rendezvous_key=f"{current.run_id}-{current.retry_count}",
            )
        self.next(self.evaluate)

    @card(type="blank", id="evaluation", timeout=600)  # rendering waits for a busy machine rather than dropping the card
    @step
    def evaluate(self, inputs):
        """Held-out reconstruction against the baselines, the downstream evaluation (fine-tuned fault
        segmentation, pretrained vs random init), and the card (loss curve, slices, label efficiency, tables)."""
        from sfm.ops import pipeline
        from sfm.eval.card import evaluation_components

        self.merge_artifacts(inputs, exclude=["train_summary"])
        self.train_summary = next(i.train_summary for i in inputs if i.train_summary is not None)
        self.model_url = self.train_summary["model_url"]
        with in_flow():
            self.metrics, figures = pipeline.evaluate(self.model_url, self.held_out_stores, self.job)
            for component in evaluation_components(self.model_url, self.held_out_stores, self.train_summary,
                                                   self.metrics, figures):
                current.card["evaluation"].append(component)
        self.next(self.register)

    @step
    def register(self):
        from metaflow import Run

        from sfm.ops import pipeline

        pathspec = f"{current.flow_name}/{current.run_id}"
        with in_flow():
            record = pipeline.register(self.root, self.job, model_url=self.model_url,
                                       metrics=self.metrics, run_pathspec=pathspec, surveys=self.train_stores,
                                       held_out=self.held_out_stores,
                                       snapshots=self.train_summary.get("snapshots"))
        self.model_name, self.model_version, self.champion = record["model_name"], record["version"], record["champion"]
        Run(pathspec).add_tag(f"model:{self.model_name}:v{self.model_version}")
        self.next(self.end)

    @step
    def end(self):
        from sfm.ops import pipeline

        for line in pipeline.closing_lines(self.train_summary, self.metrics, self.job, self.root,
                                           {"model_name": self.model_name, "version": self.model_version,
                                            "champion": self.champion}):
            print(line)

if __name__ == "__main__":
    PretrainFlow()
