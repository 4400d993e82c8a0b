"""What the stores are made of, below every layer that reads or writes them: the SEG-Y codec (:mod:`.segy`,
:mod:`.segy_geometry`, :mod:`.segy_traces`), the Zarr writer (:mod:`.zarr_writer`), the store layout's constants
(:mod:`.store_layout`), amplitude statistics (:mod:`.moments`), the MDIO layout (:mod:`.mdio_layout`), the manifest of
published surveys and label sets (:mod:`.manifest`), label stores (:mod:`.label_store`) and the data contracts
(:mod:`.contracts`)."""
