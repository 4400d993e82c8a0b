"""sfm.distributed.deepspeed_zero without processes: the DeepSpeed config a job gives, and which checkpoint files
each rank reads."""

from __future__ import annotations

from sfm.config import JobConfig
from sfm.distributed import deepspeed_zero


def job(strategy: str, **train) -> JobConfig:
    cfg = JobConfig.from_dict({"dist": {"strategy": strategy}, "data": {"batch_size": 6}, "train": train})
    cfg.validate()
    return cfg


def test_the_config_takes_the_jobs_batch_accumulation_clipping_and_precision_and_no_optimiser():
    config = deepspeed_zero.engine_config(job("deepspeed-zero2", grad_accum=3, grad_clip=0.5), 4,
                                          params=362_880, bf16=True)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (6, 3, 72)
    assert config["managed_gradient_accumulation"] is False  # each engine.step() is the step's boundary
    assert config["gradient_clipping"] == 0.5 and config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["stage"] == 2
    assert "optimizer" not in config and "scheduler" not in config  # ours: the client optimiser, our schedule
    assert deepspeed_zero.engine_config(job("deepspeed-zero2", grad_clip=0.0), 1, params=10,
                                        bf16=False)["gradient_clipping"] == 0.0


def test_buckets_and_persistence_scale_with_the_model_up_to_deepspeeds_defaults():
    tiny = deepspeed_zero.engine_config(job("deepspeed-zero3"), 2, params=362_880, bf16=False)["zero_optimization"]
    assert tiny["stage"] == 3
    assert tiny["reduce_bucket_size"] == tiny["allgather_bucket_size"] == tiny["stage3_prefetch_bucket_size"] == 45_360
    assert tiny["stage3_param_persistence_threshold"] == 362  # the tiny model's blocks' weights are partitioned
    huge = deepspeed_zero.engine_config(job("deepspeed-zero3"), 2, params=10**10, bf16=False)["zero_optimization"]
    assert huge["reduce_bucket_size"] == deepspeed_zero.DEEPSPEED_BUCKET
    assert huge["stage3_param_persistence_threshold"] == deepspeed_zero.DEEPSPEED_PERSISTENCE
    zero2 = deepspeed_zero.engine_config(job("deepspeed-zero2"), 2, params=362_880, bf16=False)["zero_optimization"]
    assert "stage3_param_persistence_threshold" not in zero2


def test_each_rank_reads_its_own_partitions_and_zero2s_module_weights():
    names = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_11_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
             "zero_to_fp32.py"]
    assert deepspeed_zero.own_files(names, 1) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
