"""Rendering of results: terminal text, markdown, JUnit and charts."""
