"""Inference engines behind one interface (:class:`generators.engines.base.InferenceEngine`): vLLM and SGLang servers
this process manages, transformers in-process, any OpenAI-compatible endpoint, and N replicas behind one engine;
``weight_sync`` and ``transports/`` carry a training run's new weights to them. ``factory.make_engine`` picks one
from a config."""
