"""A task model over a whole survey, the survey split into parts that run as separate tasks (or GPUs).

    sfm flow predict run --model sfm-faults:v3 --survey s3://b/sfm/surveys/ID.zarr \\
        --out s3://b/sfm/predictions/ID-faults.zarr --parts 8 --mirror True
    sfm flow predict run ... --with kubernetes:gpu=1,cpu=8      # each part on a GPU node
    sfm flow predict resume                                     # after a failure: only failed parts run

``sfm flow predict ...`` runs this file; in a checkout ``python flows/predict_flow.py ...`` is the same flow.

start (plan: model, survey and output checked, the store's arrays made) -> predict (one task per part:
whole shard rows) -> publish (the SEG-Y export if asked, then the store's root zarr.json, last) -> end.
Each step calls one function of ``sfm.predict`` and keeps only small artifacts (URLs, counts). Every parameter
defaults to :class:`sfm.predict.PredictOptions`'s value, as ``sfm predict``'s do; the plan ``start`` stages is the
typed job the other steps read (:func:`sfm.predict.store.staged_plan`).
"""

from metaflow import FlowSpec, Parameter, retry, step

from sfm.predict.parts import PredictOptions
from sfm.user_errors import in_flow


class PredictFlow(FlowSpec):
    model = Parameter("model", required=True, help="NAME[:vN] in --data-root's registry (NAME: its champion), or an "
                      "exported task model's folder URL")
    survey = Parameter("survey", required=True, help="a survey id or store URL, or a SEG-Y / MDIO source "
                       "(ingested into --data-root first)")
    out = Parameter("out", required=True, help="the prediction store's URL; must not exist")
    data_root = Parameter("data-root", default=PredictOptions.data_root, help="where --model NAME is registered and "
                          "--survey published or ingested")
    output = Parameter("output", default=PredictOptions.output, help="probability | classes")
    mirror = Parameter("mirror", default=PredictOptions.mirror, type=bool, help="test-time mirroring (inline/crossline "
                       "flips); default: as the task model's scores were measured")
    layout = Parameter("layout", default=PredictOptions.layout, help="sfm | mdio")
    segy = Parameter("segy", default=PredictOptions.segy, help="also write a SEG-Y with the source's trace headers here")
    parts = Parameter("parts", default=PredictOptions.parts, type=int, help="tasks the survey is split into")
    overlap = Parameter("overlap", default=PredictOptions.overlap, type=float, help="window overlap, of a crop; "
                        "default: as the task model's scores were measured")
    batch_size = Parameter("batch-size", default=PredictOptions.batch_size, type=int, help="windows per network call")

    @step
    def start(self):
        from sfm.predict import plan_prediction

        opts = PredictOptions(model=self.model, survey=self.survey, out=self.out, data_root=self.data_root,
                              output=self.output, mirror=self.mirror, layout=self.layout, segy=self.segy,
                              parts=self.parts, overlap=self.overlap, batch_size=self.batch_size)
        with in_flow():
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
