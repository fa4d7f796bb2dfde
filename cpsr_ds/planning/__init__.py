"""Planning: the fitter, the cost model, the interval planner, online planning and the plan report."""
