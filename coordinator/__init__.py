"""The DiLoCo coordinator: global parameters, outer optimizer, rounds."""
