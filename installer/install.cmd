@echo off
rem SpecChat installer for Windows: double-click this file. It runs install.ps1 (next to it)
rem with this user's rights only; options are passed on, e.g. install.cmd --torch cpu
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0install.ps1" %*
set code=%errorlevel%
echo.
pause
exit /b %code%
