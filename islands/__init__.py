"""DiLoCo islands: local training worlds that meet the coordinator every H inner steps."""
