"""SEG-Y to survey stores: reading SEG-Y (:mod:`.segy`), ingesting one survey (:mod:`.survey`),
writing the Zarr store (:mod:`.zarr_writer`), publishing it in the manifest (:mod:`.manifest`),
the stores' contracts (:mod:`.contracts`) and synthetic surveys for demos and tests (:mod:`.synth`)."""
