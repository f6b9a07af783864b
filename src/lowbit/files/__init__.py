"""Files on disk: safetensors files and Hugging Face folders, read and written.

- ``folder``: safetensors headers (checked against the file size), the dtype codes, a folder's
  weight files and index (``SafetensorsFolder``), ``config.json`` (``read_config``), refusing
  pickled-only folders;
- ``writer``: a complete folder written atomically (``CheckpointWriter``: shards, index, config,
  auxiliary tokenizer files; a temporary folder renamed at the end);
- ``regions``: one safetensors file written region by region at planned offsets (model-free);
- ``outlock`` / ``outguard``: the lock on an output folder and the check that it is not the source.
- ``atomic`` / ``refused``: the one atomic write of a file, and the one handling of a write the
  system refuses (disk full, read-only, no permission): an OSError naming the file, whichever
  library wrote it, then one OutputError line (``write_failure``, ``resumable_failure``).

Nothing here knows a quantization scheme or a layout (``lowbit.formats``) or a model.
"""
