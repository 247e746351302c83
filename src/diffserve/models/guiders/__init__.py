"""models/guiders"""
