"""kvmesh: a peer-to-peer prefill KV cache network for LLM inference.

A head node that receives a prompt looks up the longest compatible prefix already
prefilled anywhere in the fleet, fetches it as a verified chunked stream, imports
it, computes only the missing suffix and decodes locally. See docs/design.md.
"""

__version__ = "0.1.0"
