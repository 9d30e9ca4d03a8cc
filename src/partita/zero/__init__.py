"""partita.zero"""
