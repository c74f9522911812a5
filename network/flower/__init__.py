"""The Flower engine (flwr 1.41 message API): the sequential engine's round loop with remote clients.

Modules: :mod:`~network.flower.protocol` (record and key names both halves share, and the
transport of bundles, models and metrics), :mod:`~network.flower.server` (the
``FlowerEngine``, the ServerApp's side), :mod:`~network.flower.node` (``NodeHost``,
``NodeStateStore``, the ClientApp), :mod:`~network.flower.simulation` (``run_flower``:
Flower's simulation runtime on one machine) and :mod:`~network.flower.app` (the
ServerApp and ClientApp of a real deployment, ``flwr run flower/``; docs/FLOWER.md).

This package imports flwr and ray; the sequential path never imports it. Nothing is
imported here, so importing one module does not pull in the others.
"""
