"""Analysis beside the engine (never imported by it): memory estimator, planner, paper tables, probe."""
