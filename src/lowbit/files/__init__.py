"""Files on disk: safetensors files and Hugging Face folders, read and written.

- ``folder``: safetensors headers (checked against the file size), the dtype codes, a folder's
  weight files and index (``SafetensorsFolder``), ``config.json`` (``read_config``), refusing
  pickled-only folders;
- ``writer``: a complete folder written atomically (``CheckpointWriter``: shards, index, config,
  auxiliary tokenizer files; a temporary folder renamed at the end);
- ``regions``: one safetensors file written region by region at planned offsets (model-free);
- ``outlock`` / ``outguard``: the lock on an output folder and the check that it is not the source.

Nothing here knows a quantization scheme or a layout (``lowbit.formats``) or a model.
"""
