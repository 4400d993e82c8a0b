"""SEG-Y (or MDIO) to published survey stores, as steps: plan, write parts, publish (:mod:`.parts`), one survey in
one task (:mod:`.survey`), the cube's bricks (:mod:`.cube_writer`), MDIO stores registered in place
(:mod:`.mdio_source`, :mod:`.mdio_register`) and label volumes aligned with a survey (:mod:`.labels`,
:mod:`.label_sources`). The formats these steps read and write are :mod:`sfm.formats`."""
