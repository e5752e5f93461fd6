from sparseattn.cli import app

app(prog_name="sparseattn")  # `python -m sparseattn.cli` is the same command as `sparseattn`
