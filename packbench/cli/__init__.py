"""The `packbench` command line: one typer sub-app per noun, thin commands over library calls."""
