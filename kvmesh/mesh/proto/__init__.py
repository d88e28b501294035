"""Generated from ../kvmesh.proto (see the command there). After regenerating,
change ``import kvmesh_pb2`` in kvmesh_pb2_grpc.py to ``from . import kvmesh_pb2``."""
