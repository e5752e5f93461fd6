from sparseattn.cli import app

app()
