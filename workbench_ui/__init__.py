"""The Streamlit side of the workbench: the pages' shell and view-models, and the combined server."""
