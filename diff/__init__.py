"""``omforge diff``: where a fused graph or a compiled bundle drifts from its reference, and why. A tool on top of
the build (compile/, passes/) and the runtime; only the CLI imports it.

``graphs.py``: two ONNX graphs, or an export's unfused graph against its fused one, through the views
``structure.py``, ``provenance.py`` and ``parity.py``, presented by ``render.py`` (``templates/``);
``bundles.py``: two compiled bundles run side by side (needs no graph tooling); ``types.py``: the options and
results of both.
"""
