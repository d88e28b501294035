"""The network: gRPC cache service and client, capability gossip, security.

This package moves bytes with shapes and dtypes; it knows nothing of torch or mlx.
"""
