"""The ascend target's build: the lowered step graph (:mod:`.stages`), ATC command lines and ``build.sh``
(:mod:`.atc`), our ONNX parser plugins (:mod:`.atc_plugins`), the CANN rules the fake ATC and ``omforge inspect``
check (:mod:`.atc_conformance`, :mod:`.cann_matrix`, :mod:`.step_usage`) and the conformance doc's generator."""
