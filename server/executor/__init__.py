"""The executor process's serving side (in one-process mode, the same process's): the model repository, the control plane, warm-up, load overrides and shared-memory regions."""
