"""SEG-Y to survey stores: reading SEG-Y (:mod:`.segy`), ingesting one survey in one task (:mod:`.survey`) or in
parts (:mod:`.parts`, whose steps the one task runs), writing the Zarr store (:mod:`.cube_writer`,
:mod:`.zarr_writer`), publishing it in the manifest (:mod:`.manifest`), MDIO stores registered in place
(:mod:`.mdio_register`), the stores' contracts (:mod:`.contracts`) and synthetic surveys for demos and tests
(:mod:`.synth`)."""
