"""Torch-free types shared by the gateway, the services and the engine."""
