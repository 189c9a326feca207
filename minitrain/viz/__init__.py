"""Widgets for the lessons.  Each module keeps what to draw in pure, tested functions; the widget
classes only wire ipywidgets controls to them."""
