"""Running the pipeline on clusters: what nodes a job asks for (:mod:`.cluster`), Slurm
(:mod:`.slurm`), retraining when surveys land (:mod:`.watch`) and the scaling model
(:mod:`.scaling_model`)."""
