"""The app for a run: it wires the components together and shows what they do (docs/architecture.md,
The run app). It may import every component; no component imports it."""
