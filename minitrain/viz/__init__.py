"""Widgets for the lessons.  Each module keeps what to draw in pure, tested functions; the widget
classes only wire ipywidgets controls to them."""

#: ipywidgets ``style`` sizing a control's label to its text (the default width cuts long labels)
LABEL = {"description_width": "initial"}
