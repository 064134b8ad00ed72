"""Experiment scripts and the models and data they share."""
