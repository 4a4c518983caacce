"""Ray side of packbench: the only package that imports ray."""
