"""The head runtime: sessions, the cost-aware planner, async publishing, telemetry."""
