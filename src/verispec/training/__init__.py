"""Training drafts from what the engine samples: EAGLE-3 heads (`heads`: `verispec train-draft`). Above the engine,
which it drives to sample its data."""
