"""Analysis beside the engine, which never imports it: memory estimator, planner, α-β model, paper tables (python -m analysis)."""
