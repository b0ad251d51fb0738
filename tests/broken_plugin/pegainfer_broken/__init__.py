"""A deliberately broken pegainfer plugin: importing its hook module fails."""
