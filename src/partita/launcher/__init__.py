"""partita.launcher"""
