"""MiniMax-H3 checkpoints read and written: the transformer's layouts located and read whole (reader.py) or a few
tensors at a time for a streamed build (stream.py), their two naming schemes (names.py), the writer of all three
layouts for the tests and the tiny default (writer.py), the two VAEs' partitions, read and, for the tests, written
(vae.py), and the safetensors format's constants that every reader of safetensors headers shares
(safetensors_format.py). Importers name the module they use; nothing is re-exported here."""
