"""Figures: pure plotly builders (no Streamlit), min/max decimation, the Compare grid's one figure."""
