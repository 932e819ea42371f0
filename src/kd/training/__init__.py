"""Training mechanics the recipes call: the step, evaluation, on-policy sampling, model
preparation and sharding, the run's context, outputs and metric sinks, signals, the device."""
