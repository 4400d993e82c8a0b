"""A task model over a whole survey, the survey split into parts that run as separate tasks (or GPUs).

    sfm flow predict run --model sfm-faults:v3 --survey s3://b/sfm/surveys/ID.zarr \\
        --out s3://b/sfm/predictions/ID-faults.zarr --parts 8 --mirror True
    sfm flow predict run ... --with kubernetes:gpu=1,cpu=8      # each part on a GPU node
    sfm flow predict resume                                     # after a failure: only failed parts run

``sfm flow predict ...`` runs this file; in a checkout ``python flows/predict_flow.py ...`` is the same flow.

start (plan: model, survey and output checked, the store's arrays made) -> predict (one task per part:
whole shard rows) -> publish (the SEG-Y export if asked, then the store's root zarr.json, last) -> end.
Each step calls one function of ``sfm.predict`` and keeps only small artifacts (URLs, counts). The settings
are the job config's ``[predict]`` section (sfm/config.py: PredictConfig), as ``sfm predict``'s are: each
parameter defaults to the config's value, ``--set`` sets any key on top; the plan ``start`` stages is the typed
job the other steps read (:func:`sfm.predict.store.staged_plan`).
"""

import tomllib

from metaflow import Config, FlowSpec, Parameter, config_expr, retry, step

from sfm.config import DATA_ROOT, DEFAULT_TOML
from sfm.ops.cluster import SET_HELP, flow_job, job_of  # noqa: F401  (job_of: in the config expressions below)
from sfm.user_errors import in_flow


class PredictFlow(FlowSpec):
    config = Config("config", default=str(DEFAULT_TOML), parser=tomllib.loads,
                    help="TOML job config; its [predict] section holds the settings below (see sfm/config.py)")
    model = Parameter("model", required=True, help="a model reference of the registry in --data-root (sfm-faults: "
                      "its champion, sfm-faults:v3, sfm-faults:latest) or a task model's folder URL")
    survey = Parameter("survey", required=True, help="a survey id or store URL, or a SEG-Y / MDIO source "
                       "(ingested into --data-root first)")
    out = Parameter("out", required=True, help="the prediction store's URL; must not exist")
    data_root = Parameter("data-root", default=DATA_ROOT, help="where --model NAME is registered and "
                          "--survey published or ingested")
    output = Parameter("output", default=config_expr("job_of(config).predict.output"),
                       help="probability | classes; default: the config's [predict] output")
    mirror = Parameter("mirror", default=config_expr("job_of(config).predict.mirror"), type=bool,
                       help="test-time mirroring (inline/crossline flips): True | False; default: the config's, "
                       "else as the task model's scores were measured")
    layout = Parameter("layout", default=config_expr("job_of(config).predict.layout"),
                       help="sfm | mdio; default: the config's [predict] layout")
    segy = Parameter("segy", default="", help="also write a SEG-Y with the source's trace headers here")
    parts = Parameter("parts", default=config_expr("job_of(config).predict.parts"), type=int,
                      help="tasks the survey is split into; default: the config's [predict] parts")
    overlap = Parameter("overlap", default=config_expr("job_of(config).predict.overlap"), type=float,
                        help="window overlap, of a crop; default: the config's [predict] overlap, else the "
                        "task model's")
    threshold = Parameter("threshold", default=config_expr("job_of(config).predict.threshold"), type=float,
                          help="output classes of a binary task: class 1 from this probability; default: the config's "
                          "[predict] threshold, else the task model's")
    batch_size = Parameter("batch-size", default=config_expr("job_of(config).predict.batch_size"), type=int,
                           help="windows per network call; default: the config's [predict] batch_size")
    overrides = Parameter("set", default="", help=SET_HELP)

    @step
    def start(self):
        from sfm.ingest.survey import survey_store
        from sfm.predict import PredictOptions, plan_prediction

        with in_flow():
            job = flow_job(self.config, self.overrides, output=self.output, mirror=self.mirror, layout=self.layout,
                           parts=self.parts, overlap=self.overlap, batch_size=self.batch_size, threshold=self.threshold)
            opts = PredictOptions.of(job.predict, model=self.model, survey=survey_store(self.survey, self.data_root),
                                     out=self.out, data_root=self.data_root, segy=self.segy)
            plan = plan_prediction(opts)
        self.store_url, self.part_ids = plan.out, list(range(len(plan.rows)))
        self.next(self.predict, foreach="part_ids")

    # a killed part is retried at once, then `resume` runs only the parts that failed
    @retry(times=1, minutes_between_retries=0)
    @step
    def predict(self):
        """The shards of one part's shard rows."""
        from sfm.predict import run_part
        from sfm.predict.store import staged_plan

        with in_flow():
            self.part = run_part(staged_plan(self.store_url), self.input, progress=True)  # lines in the task's log
        print(f"sfm predict: part {self.input + 1} of {len(self.part_ids)}: {self.part}")
        self.next(self.publish)

    @step
    def publish(self, inputs):
        from sfm.predict import publish_prediction
        from sfm.predict.store import staged_plan

        self.merge_artifacts(inputs, include=["store_url", "part_ids"])
        self.results = sorted((i.part for i in inputs), key=lambda r: r["part"])
        with in_flow():
            self.attrs = publish_prediction(staged_plan(self.store_url))
        self.next(self.end)

    @step
    def end(self):
        ran = [r for r in self.results if not r.get("reused")]
        print(f"sfm predict: {self.store_url} published ({self.attrs['variable']}); {len(ran)} of "
              f"{len(self.results)} parts run here, {sum(r['voxels'] for r in ran) / 1e6:.1f} M voxels")


if __name__ == "__main__":
    PredictFlow()
