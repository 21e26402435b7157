"""Converters between our model directories and other toolkits'."""
