"""Model families of the native runtime: one module per family (its config mapping, weight names and
layer quirks), and the registry that maps a checkpoint's ``model_type`` to its family (:mod:`.registry`).
The seam: :mod:`.base`."""
